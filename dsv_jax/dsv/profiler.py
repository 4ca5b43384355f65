"""Sparsity profiling on the device: exact attention rows of sampled queries -> per-head statistics.

For each sampled query the critical KV are the fewest keys holding `theta` of its attention mass
(sort the row, cumulative sum). A head's sparsity is 1 - critical / S, taken conservatively as a low
percentile over the sampled queries (and the batch); the host smooths it with an EMA (controller).
Recall is the attention mass inside the current selection (the KV blocks of the query's tile). The
recall curve is the mass inside the predictor's best-scoring fraction f of the KV blocks, for each f of
RECALL_FRACTIONS: what a selection at keep ratio f would hold. The controller reads off it the keep
ratio each head needs for a recall target (dsv.recall_target).

Extra statistics for the analysis script (experiments/sparsity_analysis.py): the share of mass in
the top keys at fixed key fractions, and the mean per-axis distance (t, h, w in tokens) of a query's
critical keys from it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.lowrank_topk import block_scores

TOP_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
# Keep ratios at which the recall curve is measured (finer where sparse attention pays most).
RECALL_FRACTIONS = (
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.125,
    0.15,
    0.2,
    0.25,
    0.3,
    0.35,
    0.4,
    0.45,
    0.5,
    0.6,
    0.7,
    0.8,
    0.9,
    1.0,
)


def profile_rows(
    z,
    positions,
    n_real,
    *,
    theta: float,
    percentile: float,
    coords: np.ndarray,
    selection=None,
    q_tile: int = 1,
    kv_block: int = 1,
    lowrank=None,
    block_reduce: str = "mean",
    analysis: bool = False,
    exact=None,
    kv_valid=None,
):
    """Statistics of true logits z [B, H, Q, S] (invalid keys -inf) of queries at `positions`.

    Returns {"sparsity": [H], "recall": [H], "recall_curve": [H, len(RECALL_FRACTIONS)]} (recall NaN
    without a selection, the curve NaN without the predictor's projections `lowrank` = (q_lr, k_lr)) and,
    with `analysis`, "sparsity_mean" [H], "top_mass" [H, len(TOP_FRACTIONS)], "critical_distance" [H, 3],
    "oracle_curve" [H, 2, len(RECALL_FRACTIONS)] (the best recall of token and of kv_block selections)
    and, given the true projections `exact` = (q, k), "exact_proxy_curve" [H, len(RECALL_FRACTIONS)]: the
    recall curve of the predictor's selection rule (tile proxy, block scores) run on q, k themselves, which
    separates what sharing a selection per tile costs from what the low rank costs. kv_valid: int32
    [B, S // kv_block] on padded layouts (block scores over valid keys, as the selection scores them)."""
    b, h, nq, s = z.shape
    p = jax.nn.softmax(jax.lax.stop_gradient(z).astype(jnp.float32), axis=-1)
    desc = -jnp.sort(-p, axis=-1)
    csum = jnp.cumsum(desc, axis=-1)
    critical = jnp.sum(csum < theta, axis=-1) + 1  # [B, H, Q]
    sparsity_q = 1.0 - critical.astype(jnp.float32) / n_real
    flat = sparsity_q.transpose(1, 0, 2).reshape(h, -1)
    out = {"sparsity": jnp.percentile(flat, percentile, axis=-1)}
    out["recall"] = (
        selection_recall(p, positions, selection, q_tile, kv_block)
        if selection is not None
        else jnp.full((h,), jnp.nan, jnp.float32)
    )
    out["recall_curve"] = (
        recall_curve(p, positions, *lowrank, q_tile, kv_block, block_reduce, kv_valid)
        if lowrank is not None
        else jnp.full((h, len(RECALL_FRACTIONS)), jnp.nan, jnp.float32)
    )
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
        # upper bounds of the recall curve: single tokens, and whole blocks of this plan's granularity
        tokens = _held_at_fractions(desc)  # the rows are already sorted: the token-level oracle
        out["oracle_curve"] = jnp.stack([tokens, oracle_curve(p, kv_block)], axis=1)  # [H, 2, F]
        out["exact_proxy_curve"] = (
            recall_curve(p, positions, *exact, q_tile, kv_block, block_reduce, kv_valid)
            if exact is not None
            else jnp.full((h, len(RECALL_FRACTIONS)), jnp.nan)
        )
    return out


def _block_mass(p, kv_block: int):
    b, h, nq, s = p.shape
    return jnp.sum(p.reshape(b, h, nq, s // kv_block, kv_block), axis=-1)  # [B, H, Q, S // kv_block]


def selection_recall(p, positions, selection, q_tile: int, kv_block: int):
    """Mean attention mass [H] of sampled queries inside their tile's selected KV blocks."""
    kv_index, kv_count = selection
    tiles = jnp.asarray(np.asarray(positions) // q_tile)
    idx = kv_index[:, :, tiles]  # [B, H, Q, K]
    cnt = kv_count[:, :, tiles]  # [B, H, Q]
    block_mass = _block_mass(p, kv_block)
    picked = jnp.take_along_axis(block_mass, idx, axis=-1)
    valid = jnp.arange(idx.shape[-1]) < cnt[..., None]
    return jnp.mean(jnp.sum(jnp.where(valid, picked, 0.0), -1), axis=(0, 2))


def recall_curve(p, positions, q_lr, k_lr, q_tile: int, kv_block: int, block_reduce: str = "mean", kv_valid=None):
    """Mean attention mass [H, len(RECALL_FRACTIONS)] of sampled queries inside the ceil(f * blocks)
    KV blocks that the predictor scores highest for their query tile (as `lowrank_topk` ranks them)."""
    tiles = jnp.asarray(np.asarray(positions) // q_tile)
    scores = block_scores(
        jax.lax.stop_gradient(q_lr),
        jax.lax.stop_gradient(k_lr),
        q_tile=q_tile,
        kv_block=kv_block,
        block_reduce=block_reduce,
        tiles=tiles,
        kv_valid=kv_valid,
    )  # [B, H, Q, nb]
    order = jnp.argsort(-scores, axis=-1)
    return _held_at_fractions(jnp.take_along_axis(_block_mass(p, kv_block), order, axis=-1))


def oracle_curve(p, kv_block: int):
    """The best any selection of whole KV blocks could hold [H, len(RECALL_FRACTIONS)]: each sampled
    query's own heaviest blocks (no predictor, no sharing within a query tile)."""
    return _held_at_fractions(-jnp.sort(-_block_mass(p, kv_block), axis=-1))


def _held_at_fractions(ranked_mass):
    """Mean over batch and queries of the mass in the first ceil(f * blocks) of ranked_mass [B, H, Q, nb]."""
    held = jnp.cumsum(ranked_mass, axis=-1)
    nb = ranked_mass.shape[-1]
    # rounded as selection.head_counts rounds a keep ratio to a block count
    counts = np.array([min(nb, max(1, math.ceil(f * nb - 1e-4))) for f in RECALL_FRACTIONS])
    return jnp.mean(held[..., counts - 1], axis=(0, 2))


def keep_for_recall(curve, target: float) -> np.ndarray:
    """The smallest of RECALL_FRACTIONS whose recall in `curve` [..., F] reaches `target` (1.0 if none)."""
    enough = np.asarray(curve) >= target - 1e-9
    return np.where(enough.any(-1), np.asarray(RECALL_FRACTIONS)[np.argmax(enough, axis=-1)], 1.0)
