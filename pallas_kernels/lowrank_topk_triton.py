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
     key tau itself). The thresholds are lo + i * 2**m, the least power-of-two step that spans the bracket,
     so that a key's bucket (the thresholds it reaches) is one subtract and shift, not a comparison with each
     threshold; the buckets are counted in registers, in 8-bit fields four to an int32 word per key lane, and
     summed across lanes once per FLUSH_STEPS steps. From the whole int32 range these are a radix select's
     passes (the first spent on the sign and exponent); a seeded call's first pass instead spans a bracket of
     order statistics, around the expected rank of tau, of a strided sample of the tile's scores that XLA
     sorts (`TopkTuning.sample` keys per tile), which saves about half the passes at token level;
     experiments/bench_topk.py replays the bracketing in numpy. A sample that misses (an unrepresentative
     stride) costs passes, never exactness. On the GPU the scores are dot products at TopkTuning.precision
     (TF32 by default): the ids are the exact top-k of those; experiments/bench_topk.py measures what near-ties
     swapped against an fp32 top-k cost in attention mass.
  2. compaction: one more pass writes, in id order, every id with key > tau and the first
     (top_k - #{key > tau}) ids with key == tau, so the output is ascending and ties go to the lower
     id, as lax.top_k does. Positions come from running counts plus one in-chunk cumulative sum.

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
FLUSH_STEPS = 255  # steps between reductions of the 8-bit bucket counters (one key per lane per step)


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
    extra = lax.broadcasted_iota(jnp.int32, (tp, 32), 1)  # 32 columns, not 32 - bits: Triton wants powers of two

    def grid(base, top):
        """The pass's thresholds base + i * 2**m, i = 0 .. last: the least m with n_thresholds * 2**m >= top - base,
        and last, the final i with base + i * 2**m < top. Differences are unsigned: top - base - 1 wraps into
        int32 but its logical shifts are exact (top - base may pass 2**31)."""
        span = top - base - 1
        wide = lax.shift_right_logical(span[:, None], jnp.minimum(bits + extra, 31)) != 0
        m = jnp.sum((wide & (bits + extra < 32)).astype(jnp.int32), axis=1)
        return m, lax.shift_right_logical(span, m)

    # A key's bucket is i when base + i * 2**m <= key < base + (i + 1) * 2**m (keys >= top: `last`; below base:
    # -1, counted nowhere). One subtract and shift per key replaces a comparison with every threshold, and the
    # histogram lives in registers: each int32 word of `acc` holds four 8-bit bucket counters per (tile, key
    # lane), bumped by a one-hot field and reduced across lanes only once per FLUSH_STEPS steps.
    words = -(-n_thresholds // 4)

    def bucket_counts(base, top, m):
        def bump(chunk, acc):
            key, _ = keys_of(chunk)
            offset = jnp.minimum(key, top[:, None] - 1) - base[:, None]
            bucket = jnp.where(key >= base[:, None], lax.shift_right_logical(offset, m[:, None]), -1)
            word = lax.shift_right_arithmetic(bucket, 2)
            one = lax.shift_left(jnp.ones_like(bucket), lax.shift_left(bucket & 3, 3))
            return tuple(a + jnp.where(word == w, one, 0) for w, a in enumerate(acc))

        def flush(acc, hist):
            for w, a in enumerate(acc):
                for f in range(min(4, n_thresholds - 4 * w)):
                    lanes = lax.shift_right_logical(a, 8 * f) & 0xFF
                    hist = hist + jnp.where(j == 4 * w + f, jnp.sum(lanes, axis=1, keepdims=True), 0)
            return hist

        def steps(first, count, hist):
            fresh = tuple(jnp.zeros((tp, step), jnp.int32) for _ in range(words))
            acc = lax.fori_loop(0, count, lambda i, acc: bump(first + i, acc), fresh)
            return flush(acc, hist)

        hist = jnp.zeros((tp, n_thresholds), jnp.int32)
        full = n_steps // FLUSH_STEPS
        if full:
            hist = lax.fori_loop(0, full, lambda i, h: steps(i * FLUSH_STEPS, FLUSH_STEPS, h), hist)
        if n_steps % FLUSH_STEPS:
            hist = steps(full * FLUSH_STEPS, n_steps % FLUSH_STEPS, hist)
        return hist

    def count_pass(p, state):
        lo, c_lo, hi, c_hi, done = state
        base, top = lo, hi
        if seeded:  # the first pass spans the sample's bracket instead of the whole key range
            first = p == 0
            base = jnp.where(first, seeds_ref[:, 0], lo)
            top = jnp.where(first, jnp.maximum(seeds_ref[:, 1], base + 1), hi)
        m, last = grid(base, top)
        hist = bucket_counts(base, top, m)
        # count(t_i) = keys in buckets >= i: the total less the buckets below i (keys >= top sit in `last`).
        counts = jnp.sum(hist, axis=1, keepdims=True) - (jnp.cumsum(hist, axis=1) - hist)
        inside = j <= last[:, None]  # thresholds past `last` would reach top: stand in the old bracket's hi
        thresholds = jnp.where(inside, base[:, None] + lax.shift_left(j, m[:, None]), hi[:, None])
        counts = jnp.where(inside, counts, c_hi[:, None])
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
    sure = jnp.where(exact, prefix, prefix + 1)[:, None]
    ties_wanted = jnp.where(exact, 0, top_k - c_hi)[:, None]

    # --- 2. compaction in id order ---------------------------------------------------------------
    # A taken key's position: the sure keys before it plus the ties taken before it (at most ties_wanted). Both
    # running counts come from one scan: sure keys in the low 16 bits of a lane, ties in the high 16.
    tile_row = lax.broadcasted_iota(jnp.int32, (tp, step), 0)
    dump = top_k  # column past the output that absorbs the writes of unselected lanes

    def compact(chunk, carry):
        sure_seen, ties_seen = carry
        key, col = keys_of(chunk)
        real = col < num_keys
        is_sure = ((key >= sure) & real).astype(jnp.int32)
        is_tie = ((key == prefix[:, None]) & real).astype(jnp.int32)  # also sure when exact (ties_wanted 0)
        both = is_sure + lax.shift_left(is_tie, 16)
        before = jnp.cumsum(both, axis=1) - both
        ties_before = ties_seen[:, None] + lax.shift_right_logical(before, 16)
        take = (is_sure == 1) | ((is_tie == 1) & (ties_before < ties_wanted))
        pos = sure_seen[:, None] + (before & 0xFFFF) + jnp.minimum(ties_before, ties_wanted)
        # pos < top_k holds by construction (the passes see bitwise the same scores); the guard keeps a
        # broken invariant from writing past the row.
        out_ref[tile_row, jnp.where(take & (pos < top_k), pos, dump)] = col
        total = jnp.sum(both, axis=1)
        return sure_seen + (total & 0xFFFF), ties_seen + lax.shift_right_logical(total, 16)

    zeros = jnp.zeros((tp,), jnp.int32)
    lax.fori_loop(0, n_steps, compact, (zeros, zeros))


def first_bracket(proxy, keys, top_k: int, sample: int):
    """int32 sort keys [B, H, T, 2], low then high: the span a seeded call's first pass splits, per query tile. They
    are order statistics of `sample` scores per tile (every (num_keys // sample)-th key), 2.5 standard deviations
    (binomial) either side of the sample rank where the top_k-th largest of all num_keys scores is expected.
    proxy [B, H, T, r], keys [B, H, num_keys, r]."""
    num_keys = keys.shape[2]
    stride = num_keys // sample
    # XLA's compile aborted (triton_tiling_propagation.cc) at 128k tokens in 16-token blocks, the one seeded case
    # whose sample is a strided slice of block means; the barrier keeps that slice out of XLA's Triton GEMM fusion
    # (not yet confirmed on a GPU).
    picked = lax.optimization_barrier(keys[:, :, : stride * sample : stride].astype(jnp.float32))
    scores = jnp.einsum("bhtr,bhmr->bhtm", proxy, picked)
    ordered = jnp.sort(sortable_key(scores), axis=-1)
    share = top_k / num_keys
    half = max(1.0, 2.5 * math.sqrt(sample * share * (1.0 - share)))
    below = sample - share * sample  # ascending position of the expected tau in the sample
    low, high = (min(max(round(at), 0), sample - 1) for at in (below - half, below + half))
    return jnp.stack([ordered[..., low], ordered[..., high]], axis=-1)


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
        in_specs.append(pl.BlockSpec((None, None, tp, 2), lambda i, bi, hi: (bi, hi, i, 0)))
        args.append(first_bracket(proxy, table[:, :, 0, :num_keys], top_k, tuning.sample))
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
