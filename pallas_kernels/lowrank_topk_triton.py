"""Fused low-rank top-k selection in Pallas (Triton lowering): exact counting select, then compaction.

Per query tile we need the ids of its top_k highest-scoring KV blocks, ascending. Scores are
proxy . k_lr (rank r ~ 16), so recomputing a score costs less than storing and re-reading it; no
score matrix is ever written. Memory is the output, O(S / q_tile * top_k), plus, for a seeded call, the
sample's scores (O(S / q_tile * sample) fp32, sorted in XLA: 268 MB at 128k tokens, 16 heads).

Why threshold-then-compact rather than a streaming select: a streaming top-k needs an in-register
sort/merge, which the Pallas Triton lowering does not offer, and keeping a k-entry heap per tile does
not fit registers for k in the thousands (token level). Counting does fit:

  1. select the k-th largest key by bracketing: map fp32 scores to int32 keys with the same order and
     keep, per tile, a bracket [lo, hi) of keys with count(lo) >= top_k > count(hi), where count(t) is
     how many keys are >= t. One pass over the keys counts them at 2**radix_bits thresholds inside the
     bracket at once and keeps the two neighbouring thresholds around top_k. A tile stops once a
     threshold has exactly top_k keys at or above it, or once hi = lo + 1 (lo is then the k-th largest
     key tau itself). Thresholds split the bracket evenly in key space (from the whole int32 range: the
     first passes of a radix select, spent on the sign and exponent), except the first pass of a seeded
     call: its thresholds are order statistics, around the expected rank of tau, of a strided sample of
     the tile's scores that XLA sorts (`TopkTuning.sample` keys per tile). Token level at 128k keys
     then takes ~3.4 counting passes per tile instead of ~6.8 (a program runs its slowest tile's: ~4.5
     instead of ~7.9; experiments/bench_topk.py replays the bracketing in numpy); a sample that misses
     (an unrepresentative stride) costs passes, never exactness. On the GPU the scores are dot products
     at TopkTuning.precision (TF32 by default): the ids are the exact top-k of those; experiments/bench_topk.py
     measures what near-ties swapped against an fp32 top-k cost in attention mass.
  2. compaction: one more pass writes, in id order, every id with key > tau and the first
     (top_k - #{key > tau}) ids with key == tau, so the output is ascending and ties go to the lower
     id, as lax.top_k does. Positions come from a running count plus an in-chunk cumulative sum.

A program handles `tiles_per_program` query tiles, which share every load of the key table.

Padded layouts (kv_valid): proxies and block means are taken over valid rows in XLA, as the reference
does; the kernel also reads each block's valid count beside its scores, so that the max over a block
skips its padded rows and a block without a valid key gets the key of -inf (ranked below every real
score, above the INT_MIN of the padding columns).
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.lowrank_topk_reference import block_mean_keys, row_flags, tile_proxies
from pallas_kernels.partitioning import partitioned_over_batch_and_heads
from pallas_kernels.sparse_index import result_type
from pallas_kernels.tuning import TopkTuning

INT_MIN = -(2**31)
INT_MAX = 2**31 - 1
SEED_MIN_RATIO = 4  # seed the first pass only when a tile has this many times `sample` keys
NEG_INF_KEY = -2139095041  # sortable_key(-inf): the bits 0xFF800000 with the magnitude bits flipped


def sortable_key(score):
    """fp32 -> int32 with the same order (negative floats: flip the magnitude bits)."""
    bits = lax.bitcast_convert_type(score, jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def score_precision(name: str, interpret: bool):
    """The `precision` of the kernel's score dot for TopkTuning.precision `name` (None: Triton's default for
    fp32, TF32). Interpret mode runs the dot in XLA on the host, which has no TF32 (nor the TF32x3 algorithm):
    fp32 there."""
    if interpret or name == "ieee":
        return lax.Precision.HIGHEST
    return {
        "tf32": None,
        "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
        "bf16x3": lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
    }[name]


def _select_kernel(
    proxy_ref,
    table_ref,
    *refs,
    top_k: int,
    num_keys: int,
    reduce: str,
    tuning: TopkTuning,
    masked: bool,
    seeded: bool,
    interpret: bool,
):
    refs = list(refs)
    seeds_ref = refs.pop(0) if seeded else None
    valid_ref = refs.pop(0) if masked else None
    (out_ref,) = refs
    tp = proxy_ref.shape[0]
    rows, padded_keys = table_ref.shape[0], table_ref.shape[1]
    step = tuning.keys_per_step
    n_steps = padded_keys // step
    proxy = proxy_ref[...].astype(jnp.float32)  # [tp, r]
    dot_precision = score_precision(tuning.precision, interpret)

    def keys_of(chunk):
        """int32 sort keys [tp, step] of keys chunk * step ... + step; padding keys get INT_MIN."""
        sl = pl.ds(pl.multiple_of(chunk * step, step), step)

        n_valid = None if valid_ref is None else valid_ref[sl][None, :]  # [1, step] valid rows per block

        def row_scores(j):
            score = plgpu.dot(proxy, table_ref[j, sl, :].astype(jnp.float32), trans_b=True, precision=dot_precision)
            if n_valid is not None and rows > 1:  # the max skips padded rows
                score = jnp.where(j < n_valid, score, -jnp.inf)
            return score

        if rows == 1:
            score = row_scores(0)
        else:  # block score = reduce over the block's rows (row j of every block is table[j])
            combine = jnp.maximum if reduce == "max" else jnp.add
            score = lax.fori_loop(1, rows, lambda j, acc: combine(acc, row_scores(j)), row_scores(0))
            if reduce == "mean":
                score = score / rows
        key = sortable_key(score)
        if n_valid is not None:
            key = jnp.where(n_valid > 0, key, NEG_INF_KEY)
        col = chunk * step + lax.broadcasted_iota(jnp.int32, (tp, step), 1)
        return jnp.where(col < num_keys, key, INT_MIN), col

    # --- 1. bracket the top_k-th largest key per tile --------------------------------------------
    bits = tuning.radix_bits
    n_thresholds = 1 << bits
    j = lax.broadcasted_iota(jnp.int32, (tp, n_thresholds), 1)

    def split(lo, hi):
        """Thresholds lo, lo + w, ..., lo + (n - 1) w with w ~ (hi - lo) / n, at least 1. In the widest
        brackets j * w passes 2**31, but lo + j * w <= hi does not, so int32's wrapping sum is exact."""
        w = jnp.maximum(lax.shift_right_arithmetic(hi, bits) - lax.shift_right_arithmetic(lo, bits), 1)
        return lo[:, None] + j * w[:, None]

    def count_pass(p, state):
        lo, c_lo, hi, c_hi, done = state
        thresholds = split(lo, hi)
        if seeded:
            thresholds = jnp.where(p == 0, seeds_ref[...], thresholds)

        def body(chunk, counts):
            key, _ = keys_of(chunk)
            above = key[:, :, None] >= thresholds[:, None, :]  # [tp, step, n_thresholds]
            return counts + jnp.sum(above.astype(jnp.int32), axis=1)

        counts = lax.fori_loop(0, n_steps, body, jnp.zeros((tp, n_thresholds), jnp.int32))
        enough = counts >= top_k  # count(t) falls as t rises: the bracket is the last True, first False
        new = (
            jnp.max(jnp.where(enough, thresholds, lo[:, None]), axis=1),
            jnp.min(jnp.where(enough, counts, c_lo[:, None]), axis=1),
            jnp.min(jnp.where(enough, hi[:, None], thresholds), axis=1),
            jnp.max(jnp.where(enough, c_hi[:, None], counts), axis=1),
        )
        lo, c_lo, hi, c_hi = (jnp.where(done, old, upd) for old, upd in zip(state[:4], new, strict=True))
        return lo, c_lo, hi, c_hi, done | (c_lo == top_k) | (hi - lo == 1)

    def not_finished(carry):
        p, state = carry
        return (p < 32 // bits + 4) & (jnp.min(state[4].astype(jnp.int32)) == 0)

    def one_pass(carry):
        p, state = carry
        return p + 1, count_pass(p, state)

    # count(INT_MIN) counts the padding too; no finite score's key reaches INT_MAX, so count(INT_MAX) = 0.
    start = (
        jnp.full((tp,), INT_MIN, jnp.int32),
        jnp.full((tp,), padded_keys, jnp.int32),
        jnp.full((tp,), INT_MAX, jnp.int32),
        jnp.zeros((tp,), jnp.int32),
        jnp.full((tp,), padded_keys == top_k),
    )
    _, (prefix, c_lo, _, c_hi, _) = lax.while_loop(not_finished, one_pass, (jnp.int32(0), start))

    # Exactly top_k keys >= prefix (lo): take them all. Otherwise hi = lo + 1, so prefix is the k-th key
    # tau itself: take keys > tau and the first top_k - #{> tau} keys equal to tau.
    exact = c_lo == top_k
    sure = jnp.where(exact, prefix, prefix + 1)
    ties_wanted = jnp.where(exact, 0, top_k - c_hi)

    # --- 2. compaction in id order ---------------------------------------------------------------
    tile_row = lax.broadcasted_iota(jnp.int32, (tp, step), 0)
    dump = top_k  # column past the output that absorbs the writes of unselected lanes

    def compact(chunk, carry):
        written, ties_seen = carry
        key, col = keys_of(chunk)
        tie = (key == prefix[:, None]).astype(jnp.int32)
        tie_rank = ties_seen[:, None] + jnp.cumsum(tie, axis=1) - tie
        take = ((key >= sure[:, None]) | ((tie == 1) & (tie_rank < ties_wanted[:, None]))) & (col < num_keys)
        take_i = take.astype(jnp.int32)
        pos = written[:, None] + jnp.cumsum(take_i, axis=1) - take_i
        # pos < top_k holds by construction (the passes see bitwise the same scores); the guard keeps a
        # broken invariant from writing past the row.
        out_ref[tile_row, jnp.where(take & (pos < top_k), pos, dump)] = col
        return written + jnp.sum(take_i, axis=1), ties_seen + jnp.sum(tie, axis=1)

    zeros = jnp.zeros((tp,), jnp.int32)
    lax.fori_loop(0, n_steps, compact, (zeros, zeros))


def first_thresholds(proxy, keys, top_k: int, sample: int, n: int):
    """int32 sort keys [B, H, T, n], ascending: a seeded call's first thresholds per query tile. They are order
    statistics of `sample` scores per tile (every (num_keys // sample)-th key), around the sample rank where
    the top_k-th largest of all num_keys scores is expected, spaced so that the n of them span about +-2.5
    standard deviations of that rank (binomial). proxy [B, H, T, r], keys [B, H, num_keys, r]."""
    num_keys = keys.shape[2]
    stride = num_keys // sample
    scores = jnp.einsum("bhtr,bhmr->bhtm", proxy, keys[:, :, : stride * sample : stride].astype(jnp.float32))
    ordered = jnp.sort(sortable_key(scores), axis=-1)
    share = top_k / num_keys
    spacing = max(1, round(5.0 * math.sqrt(sample * share * (1.0 - share)) / n))
    below = sample - share * sample  # ascending position of the expected tau in the sample
    first = round(below - spacing * (n - 1) / 2)
    at = jnp.clip(first + spacing * lax.iota(jnp.int32, n), 0, sample - 1)  # traced: no captured constant
    return jnp.take(ordered, at, axis=-1)


def lowrank_topk_pallas(
    q_lr, k_lr, top_k, *, q_tile, kv_block, block_reduce, tuning: TopkTuning, interpret, kv_valid=None
):
    """Inputs as the public lowrank_topk (already checked); returns int32 [B, H, S // q_tile, top_k].
    Partitionable over B and H like the attention kernels (each device selects for its own heads)."""
    static = (top_k, q_tile, kv_block, block_reduce, tuning, interpret)
    if kv_valid is None:
        return _select_sharded(q_lr, k_lr, static)
    return _select_masked_sharded(q_lr, k_lr, kv_valid.astype(jnp.int32), static)


def _select(q_lr, k_lr, static, kv_valid=None):
    top_k, q_tile, kv_block, block_reduce, tuning, interpret = static
    b, s, h, r = q_lr.shape
    tiles, num_keys = s // q_tile, s // kv_block
    tp = min(tuning.tiles_per_program, pl.next_power_of_2(tiles))
    tp = max(tp, 16)
    step = tuning.keys_per_step
    rp = max(16, pl.next_power_of_2(r))
    masked = kv_valid is not None
    if masked:
        kv_valid = jnp.clip(kv_valid, 0, kv_block)

    # Proxies exactly as the reference computes them (fp32 mean of the tile's (valid) rows).
    proxy = tile_proxies(q_lr, q_tile, None if kv_valid is None else row_flags(kv_valid, kv_block))
    proxy = proxy.transpose(0, 2, 1, 3)
    tiles_p = -(-tiles // tp) * tp
    proxy = jnp.pad(proxy, ((0, 0), (0, 0), (0, tiles_p - tiles), (0, rp - r)))

    # Key table [B, H, rows, num_keys, r]: the block score is the reduce over `rows` dot products.
    if kv_block == 1:
        table = k_lr.transpose(0, 2, 1, 3)[:, :, None]
    elif block_reduce == "mean":  # mean of dot products = dot product with the block's mean (valid) row
        table = block_mean_keys(k_lr, kv_block, kv_valid).transpose(0, 2, 1, 3)[:, :, None]
    else:
        table = k_lr.reshape(b, num_keys, kv_block, h, r).transpose(0, 3, 2, 1, 4)
    keys_p = -(-num_keys // step) * step
    table = jnp.pad(table, ((0, 0), (0, 0), (0, 0), (0, keys_p - num_keys), (0, rp - r)))
    rows = table.shape[2]

    in_specs = [
        pl.BlockSpec((None, None, tp, rp), lambda i, bi, hi: (bi, hi, i, 0)),
        pl.BlockSpec((None, None, rows, keys_p, rp), lambda i, bi, hi: (bi, hi, 0, 0, 0)),
    ]
    args = [proxy, table]
    seeded = rows == 1 and tuning.sample > 0 and num_keys >= SEED_MIN_RATIO * tuning.sample
    if seeded:
        n_thresholds = 1 << tuning.radix_bits
        in_specs.append(pl.BlockSpec((None, None, tp, n_thresholds), lambda i, bi, hi: (bi, hi, i, 0)))
        args.append(first_thresholds(proxy, table[:, :, 0, :num_keys], top_k, tuning.sample, n_thresholds))
    if masked:
        in_specs.append(pl.BlockSpec((None, keys_p), lambda i, bi, hi: (bi, 0)))
        args.append(jnp.pad(kv_valid, ((0, 0), (0, keys_p - num_keys))))
    kernel = functools.partial(
        _select_kernel,
        top_k=top_k,
        num_keys=num_keys,
        reduce=block_reduce,
        tuning=tuning,
        masked=masked,
        seeded=seeded,
        interpret=interpret,
    )
    out = pl.pallas_call(
        kernel,
        grid=(tiles_p // tp, b, h),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, tp, top_k + 1), lambda i, bi, hi: (bi, hi, i, 0)),
        out_shape=result_type((b, h, tiles_p, top_k + 1), jnp.int32, proxy),
        compiler_params=plgpu.CompilerParams(num_warps=tuning.warps, num_stages=tuning.stages),
        interpret=interpret,
        name="lowrank_topk",
    )(*args)
    return out[:, :, :tiles, :top_k]


_select_sharded = partitioned_over_batch_and_heads(_select, ("bshr", "bshr"), ("bhtk",))


def _select_masked(q_lr, k_lr, kv_valid, static):
    return _select(q_lr, k_lr, static, kv_valid)


_select_masked_sharded = partitioned_over_batch_and_heads(
    _select_masked, ("bshr", "bshr", "bn"), ("bhtk",)
)  # kv_valid [B, S // kv_block]: batch-sharded
