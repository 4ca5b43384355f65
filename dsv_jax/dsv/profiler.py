"""Sparsity profiling on the device: exact attention rows of sampled queries -> per-head statistics.

For each sampled query the critical KV are the fewest keys holding `theta` of its attention mass
(sort the row, cumulative sum). A head's sparsity is 1 - critical / S, taken conservatively as a low
percentile over the sampled queries (and the batch); the host smooths it with an EMA (controller).
Recall is the attention mass inside the current selection (the KV blocks of the query's tile).

Extra statistics for the analysis script (experiments/sparsity_analysis.py): the share of mass in
the top keys at fixed key fractions, and the mean per-axis distance (t, h, w in tokens) of a query's
critical keys from it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

TOP_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


def profile_rows(z, positions, n_real, *, theta: float, percentile: float, coords: np.ndarray,
                 selection=None, q_tile: int = 1, kv_block: int = 1, analysis: bool = False):
    """Statistics of true logits z [B, H, Q, S] (invalid keys -inf) of queries at `positions`.

    Returns {"sparsity": [H], "recall": [H]} (recall NaN without a selection) and, with `analysis`,
    "sparsity_mean" [H], "top_mass" [H, len(TOP_FRACTIONS)], "critical_distance" [H, 3]."""
    b, h, nq, s = z.shape
    p = jax.nn.softmax(jax.lax.stop_gradient(z).astype(jnp.float32), axis=-1)
    desc = -jnp.sort(-p, axis=-1)
    csum = jnp.cumsum(desc, axis=-1)
    critical = jnp.sum(csum < theta, axis=-1) + 1  # [B, H, Q]
    sparsity_q = 1.0 - critical.astype(jnp.float32) / n_real
    flat = sparsity_q.transpose(1, 0, 2).reshape(h, -1)
    out = {"sparsity": jnp.percentile(flat, percentile, axis=-1)}
    out["recall"] = (selection_recall(p, positions, selection, q_tile, kv_block) if selection is not None
                     else jnp.full((h,), jnp.nan, jnp.float32))
    if analysis:
        out["sparsity_mean"] = jnp.mean(flat, axis=-1)
        ks = [max(1, int(round(f * n_real))) for f in TOP_FRACTIONS]
        out["top_mass"] = jnp.stack([jnp.mean(csum[..., k - 1], axis=(0, 2)) for k in ks], axis=-1)
        # critical set = keys at least as likely as the critical-th largest (ties are rare)
        cut = jnp.take_along_axis(desc, (critical - 1)[..., None], axis=-1)
        crit = (p >= cut).astype(jnp.float32)  # [B, H, Q, S]
        c = jnp.asarray(coords[:s], jnp.float32)  # [S, 3]
        qc = jnp.asarray(coords[np.asarray(positions)], jnp.float32)  # [Q, 3]
        dist = [jnp.einsum("bhqk,qk->bhq", crit, jnp.abs(qc[:, None, a] - c[None, :, a])) for a in range(3)]
        dist = jnp.stack(dist, -1) / jnp.sum(crit, -1, keepdims=True)  # [B, H, Q, 3]
        out["critical_distance"] = jnp.mean(dist, axis=(0, 2))
    return out


def selection_recall(p, positions, selection, q_tile: int, kv_block: int):
    """Mean attention mass [H] of sampled queries inside their tile's selected KV blocks."""
    kv_index, kv_count = selection
    b, h, nq, s = p.shape
    tiles = jnp.asarray(np.asarray(positions) // q_tile)
    idx = kv_index[:, :, tiles]  # [B, H, Q, K]
    cnt = kv_count[:, :, tiles]  # [B, H, Q]
    block_mass = jnp.sum(p.reshape(b, h, nq, s // kv_block, kv_block), axis=-1)
    picked = jnp.take_along_axis(block_mass, idx, axis=-1)
    valid = jnp.arange(idx.shape[-1]) < cnt[..., None]
    return jnp.mean(jnp.sum(jnp.where(valid, picked, 0.0), -1), axis=(0, 2))
