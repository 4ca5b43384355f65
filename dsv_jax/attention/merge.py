"""Exact merge of attention results over disjoint key sets, from each part's output and log-sum-exp.

With lse_i = log sum_{j in part i} exp(s_j): lse = logaddexp(lse_a, lse_b) and
o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b. A part with lse = -inf (no key) has weight 0; if both
have none, o = 0 and lse = -inf. Every exp sees a finite argument or -inf, so neither the values nor
the gradients (with respect to both o's and both lse's) hold NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def merge_attention(o_a, lse_a, o_b, lse_b):
    """o_a, o_b [B, S, H, D]; lse_a, lse_b [B, H, S] (natural log). -> (o [B, S, H, D], lse [B, H, S] fp32).
    o has the promoted dtype of o_a and o_b (computed in fp32)."""
    b, s, h, _ = o_a.shape
    if o_b.shape != o_a.shape or lse_a.shape != (b, h, s) or lse_b.shape != (b, h, s):
        raise ValueError(
            f"merge_attention expects o [B, S, H, D] and lse [B, H, S] for both parts; got "
            f"{o_a.shape}, {lse_a.shape}, {o_b.shape}, {lse_b.shape}"
        )
    lse_a, lse_b = lse_a.astype(jnp.float32), lse_b.astype(jnp.float32)
    m = jax.lax.stop_gradient(jnp.maximum(lse_a, lse_b))
    m = jnp.where(m == -jnp.inf, 0.0, m)
    w_a, w_b = jnp.exp(lse_a - m), jnp.exp(lse_b - m)
    total = w_a + w_b
    some = total > 0.0
    total = jnp.where(some, total, 1.0)
    lse = jnp.where(some, m + jnp.log(total), -jnp.inf)
    weight = lambda w: jnp.swapaxes(w / total, 1, 2)[..., None]
    o = weight(w_a) * o_a.astype(jnp.float32) + weight(w_b) * o_b.astype(jnp.float32)
    return o.astype(jnp.result_type(o_a.dtype, o_b.dtype)), lse
