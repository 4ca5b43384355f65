"""Fused low-rank top-k selection in Pallas (Triton lowering): exact radix select, then compaction.

Per query tile we need the ids of its top_k highest-scoring KV blocks, ascending. Scores are
proxy . k_lr (rank r ~ 16), so recomputing a score costs less than storing and re-reading it; no
score matrix is ever written. Memory is the output, O(S / q_tile * top_k).

Why threshold-then-compact rather than a streaming select: a streaming top-k needs an in-register
sort/merge, which the Pallas Triton lowering does not offer, and keeping a k-entry heap per tile does
not fit registers for k in the thousands (token level). Counting does fit:

  1. radix select (`radix_bits` per pass): map fp32 scores to int32 keys with the same order; with
     prefix = the bits of the k-th largest key found so far, one pass over the keys counts, for the
     2**radix_bits candidate next digits at once, how many keys are >= prefix + digit << shift, and
     keeps the largest digit whose count is still >= top_k. A tile stops early once exactly top_k keys
     are >= its prefix; otherwise 32 / radix_bits passes give the k-th largest key tau exactly. The
     passes needed grow with log2(number of keys) (about 6 of the 8 at 4 bits for 128k tokens), so
     token-level selection costs several passes of score recomputation; block level is cheap.
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

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.lowrank_topk import block_mean_keys, row_flags, tile_proxies
from pallas_kernels.sparse_attention_triton import partitioned_over_batch_and_heads
from pallas_kernels.sparse_index import result_type
from pallas_kernels.tuning import TopkTuning

INT_MIN = -(2**31)
NEG_INF_KEY = -2139095041  # sortable_key(-inf): the bits 0xFF800000 with the magnitude bits flipped


def sortable_key(score):
    """fp32 -> int32 with the same order (negative floats: flip the magnitude bits)."""
    bits = lax.bitcast_convert_type(score, jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _select_kernel(proxy_ref, table_ref, *refs, top_k: int, num_keys: int, reduce: str, tuning: TopkTuning,
                   masked: bool):
    valid_ref, out_ref = refs if masked else (None, refs[0])
    tp = proxy_ref.shape[0]
    rows, padded_keys = table_ref.shape[0], table_ref.shape[1]
    step = tuning.keys_per_step
    n_steps = padded_keys // step
    proxy = proxy_ref[...].astype(jnp.float32)  # [tp, r]

    def keys_of(chunk):
        """int32 sort keys [tp, step] of keys chunk * step ... + step; padding keys get INT_MIN."""
        sl = pl.ds(pl.multiple_of(chunk * step, step), step)

        n_valid = None if valid_ref is None else valid_ref[sl][None, :]  # [1, step] valid rows per block

        def row_scores(j):
            score = plgpu.dot(proxy, table_ref[j, sl, :].astype(jnp.float32), trans_b=True)
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

    # --- 1. radix select of the top_k-th largest key per tile -----------------------------------
    bits = tuning.radix_bits
    n_digits = 1 << bits
    digits = lax.broadcasted_iota(jnp.int32, (tp, n_digits), 1)

    def count_pass(p, state):
        prefix, c_lo, c_hi, done = state
        shift = 32 - bits * (p + 1)
        thresholds = prefix[:, None] + lax.shift_left(digits, jnp.broadcast_to(shift, digits.shape))

        def body(chunk, counts):
            key, _ = keys_of(chunk)
            above = key[:, :, None] >= thresholds[:, None, :]  # [tp, step, n_digits]
            return counts + jnp.sum(above.astype(jnp.int32), axis=1)

        counts = lax.fori_loop(0, n_steps, body, jnp.zeros((tp, n_digits), jnp.int32))
        digit = jnp.sum((counts >= top_k).astype(jnp.int32), axis=1) - 1  # counts[:, 0] = c_lo >= top_k
        new_c_lo = jnp.sum(jnp.where(digits == digit[:, None], counts, 0), axis=1)
        above_next = jnp.sum(jnp.where(digits == digit[:, None] + 1, counts, 0), axis=1)
        new_c_hi = jnp.where(digit == n_digits - 1, c_hi, above_next)
        new_prefix = prefix + lax.shift_left(digit, jnp.broadcast_to(shift, digit.shape))
        keep = done
        return (jnp.where(keep, prefix, new_prefix), jnp.where(keep, c_lo, new_c_lo),
                jnp.where(keep, c_hi, new_c_hi), keep | (new_c_lo == top_k))

    def not_finished(carry):
        p, state = carry
        return (p < 32 // bits) & (jnp.min(state[3].astype(jnp.int32)) == 0)

    def one_pass(carry):
        p, state = carry
        return p + 1, count_pass(p, state)

    start = (jnp.full((tp,), INT_MIN, jnp.int32), jnp.full((tp,), padded_keys, jnp.int32),
             jnp.zeros((tp,), jnp.int32), jnp.full((tp,), padded_keys == top_k))
    _, (prefix, c_lo, c_hi, _) = lax.while_loop(not_finished, one_pass, (jnp.int32(0), start))

    # Exactly top_k keys >= prefix: take them all. Otherwise prefix is the k-th key tau itself:
    # take keys > tau and the first top_k - #{> tau} keys equal to tau.
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


def lowrank_topk_pallas(q_lr, k_lr, top_k, *, q_tile, kv_block, block_reduce, tuning: TopkTuning, interpret,
                        kv_valid=None):
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

    in_specs = [pl.BlockSpec((None, None, tp, rp), lambda i, bi, hi: (bi, hi, i, 0)),
                pl.BlockSpec((None, None, rows, keys_p, rp), lambda i, bi, hi: (bi, hi, 0, 0, 0))]
    args = [proxy, table]
    if masked:
        in_specs.append(pl.BlockSpec((None, keys_p), lambda i, bi, hi: (bi, 0)))
        args.append(jnp.pad(kv_valid, ((0, 0), (0, keys_p - num_keys))))
    kernel = functools.partial(_select_kernel, top_k=top_k, num_keys=num_keys, reduce=block_reduce, tuning=tuning,
                               masked=masked)
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
    _select_masked, ("bshr", "bshr", "bn"), ("bhtk",))  # kv_valid [B, S // kv_block]: batch-sharded
