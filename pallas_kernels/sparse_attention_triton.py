"""Block-sparse attention in Pallas (Triton lowering): forward, dQ and dK/dV kernels and the custom_vjp.

Layout: q, k, v [B, S, H, Dp] with Dp = D padded to a power of two (zeros leave q.k unchanged);
kv_index [B, H, T, Kp] sanitized (entries past the count are 0) and padded so that a loop step never
reads past the end; kv_count [B, H, T].

  forward  grid (T, B, H): for kv_count[tile] selected blocks, `rows_per_step` KV rows per step, online
           softmax in base 2 (logits pre-multiplied by log2 e, so exp2 is one instruction); saves
           lse = m + log2(l) per row for the backward (+inf for a row with no valid key, so that
           the backward's exp2(s - lse) is 0 there; the public lse is natural log, -inf there).
  dQ       grid (T, B, H): the same walk; recomputes p from lse, dq += (p * (do.v - delta)) k, with
           delta = rowsum(o * do) - dlse (a cotangent of the lse output enters here).
  dK/dV    grid (S // rows, B, H): each program owns `rows` key rows and walks the query tiles that
           selected them (sparse_index.dkdv_worklist: a transposed index built by counting or a sort, no atomics);
           at token level a bit mask per pair zeroes the rows the tile did not select.

Padded keys (kv_valid): a per-row flag key_valid [B, S] (row r of block j is valid iff r % kv_block <
kv_valid[j]) is loaded beside the K rows of each step, and the scores of invalid rows are replaced by
the mask value in the same select as the live-entry mask: no extra pass. The forward's running max
starts at M_FLOOR (finite, above MASK_VALUE), so a step, or a whole row, of masked scores adds exactly
0 and a row without a valid key ends with l = 0: o = 0. dK/dV of invalid rows are zeroed when stored
(an invalid row's dk, dv depend only on its own column of p).

A loop step either covers `rows_per_step` consecutive rows of one block (kv_block a multiple of it:
plain contiguous loads) or gathers rows_per_step // kv_block selected blocks through a row-index vector
(token level and small blocks); entries past kv_count are masked in the last step only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.partitioning import partitioned_over_batch_and_heads
from pallas_kernels.sparse_attention_reference import LOG2E, kernel_lse, lse2_attention_vjp, row_term
from pallas_kernels.sparse_index import MASK_BITS, dkdv_worklist, result_type, sanitize_index
from pallas_kernels.tuning import SparseAttentionTuning, for_device

MASK_VALUE = -1e30  # finite: exp2(MASK_VALUE - m) is 0 without inf - inf
M_FLOOR = -1e29  # start of the running max: exp2(MASK_VALUE - M_FLOOR) == 0, and below any real logit


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Static geometry of one call (hashable: it is a nondiff argument of the custom_vjp)."""

    q_tile: int
    kv_block: int
    seq_len: int
    head_dim: int
    sm_scale: float
    tuning: SparseAttentionTuning
    interpret: bool

    @property
    def step_rows(self) -> int:
        return self.tuning.rows_per_step

    @property
    def contiguous(self) -> bool:  # one step = consecutive rows of a single selected block
        return self.kv_block % self.step_rows == 0

    @property
    def dkdv_rows(self) -> int:
        """Key rows per dK/dV program: whole blocks (up to 128 rows) from kv_block = 32 on; below, the tuned
        row count, halved until it divides S (S is a multiple of q_tile >= 16, so this stops at 16)."""
        if self.kv_block >= 32:
            return min(self.kv_block, 128)
        rows = self.tuning.dkdv_rows
        while self.seq_len % rows:
            rows //= 2
        return max(rows, self.kv_block)

    @property
    def masked_dkdv(self) -> bool:
        return self.kv_block < self.dkdv_rows

    def padded_count(self, n_sel: int) -> int:
        per_step = max(1, self.step_rows // self.kv_block)
        return -(-n_sel // per_step) * per_step


def padded_head_dim(d: int) -> int:
    return max(16, pl.next_power_of_2(d))


def supported(q, k, v, *, q_tile: int, kv_block: int) -> str | None:
    """None if the Pallas kernels handle this geometry and these dtypes, else the reason."""
    if q_tile < 16 or q_tile & (q_tile - 1) or q_tile > 128:
        return f"q_tile={q_tile} must be a power of two in 16..128 for the Pallas kernels"
    if kv_block & (kv_block - 1):
        return f"kv_block={kv_block} must be a power of two for the Pallas kernels"
    if not q.dtype == k.dtype == v.dtype:
        return f"one dtype for q, k, v needed; got {q.dtype}, {k.dtype}, {v.dtype}"
    return None


def _params(warps, stages):
    return plgpu.CompilerParams(num_warps=warps, num_stages=stages)


# ----------------------------------------------------------------------------------------------------
# KV walk shared by the forward and dQ kernels


def _kv_step(step, count, idx_ref, k_ref, v_ref, valid_ref, launch: LaunchConfig):
    """K, V rows [rows_per_step, Dp] of loop step `step` and the mask of live rows (None: all live).
    A row is live if its entry is < count and (with valid_ref, the key_valid row flags) a valid key."""
    rows, kvb = launch.step_rows, launch.kv_block
    if launch.contiguous:
        first = step * rows
        block = idx_ref[lax.div(first, kvb)]
        start = pl.multiple_of(block * kvb + lax.rem(first, kvb), rows)
        sl = pl.ds(start, rows)
        live = None if valid_ref is None else valid_ref[sl] != 0
        return k_ref[sl, :], v_ref[sl, :], live
    flat = step * rows + lax.broadcasted_iota(jnp.int32, (rows,), 0)  # position in the selected-row stream
    entry = lax.div(flat, kvb)
    live = entry < count
    row = idx_ref[entry] * kvb + lax.rem(flat, kvb)  # gathered row ids (entries past count were sanitized to 0)
    if valid_ref is not None:
        live = live & (valid_ref[row] != 0)
    return k_ref[row, :], v_ref[row, :], live


def _num_steps(count, launch: LaunchConfig):
    return lax.div(count * launch.kv_block + launch.step_rows - 1, launch.step_rows)


def _split_valid(refs, masked: bool):
    """(key_valid ref or None, the other refs): key_valid is the last input when the call is masked."""
    return (refs[0], refs[1:]) if masked else (None, refs)


def _fwd_kernel(count_ref, idx_ref, q_ref, k_ref, v_ref, *refs, launch: LaunchConfig, masked: bool):
    valid_ref, (o_ref, lse_ref) = _split_valid(refs, masked)
    count = count_ref[pl.program_id(0)]
    q = q_ref[...]
    qt, dp = q.shape
    qk_scale = launch.sm_scale * LOG2E

    def body(step, carry):
        acc, m_prev, l_prev = carry
        k, v, live = _kv_step(step, count, idx_ref, k_ref, v_ref, valid_ref, launch)
        s = plgpu.dot(q, k, trans_b=True) * qk_scale
        if live is not None:
            s = jnp.where(live[None, :], s, MASK_VALUE)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        alpha = jnp.exp2(m_prev - m_next)
        p = jnp.exp2(s - m_next[:, None])
        l_next = l_prev * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return acc, m_next, l_next

    init = (jnp.zeros((qt, dp), jnp.float32), jnp.full((qt,), M_FLOOR, jnp.float32), jnp.zeros((qt,), jnp.float32))
    acc, m, l = lax.fori_loop(0, _num_steps(count, launch), body, init)
    empty = l == 0.0  # no valid key (all masked, or kv_count == 0): o = 0, lse = +inf (backward's p = 0)
    l = jnp.where(empty, 1.0, l)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log2(l))


def _dq_kernel(
    count_ref, idx_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, launch: LaunchConfig, masked: bool
):
    valid_ref, (dq_ref,) = _split_valid(refs, masked)
    count = count_ref[pl.program_id(0)]
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    qk_scale = launch.sm_scale * LOG2E

    def body(step, dq):
        k, v, live = _kv_step(step, count, idx_ref, k_ref, v_ref, valid_ref, launch)
        p = jnp.exp2(plgpu.dot(q, k, trans_b=True) * qk_scale - lse[:, None])
        if live is not None:
            p = jnp.where(live[None, :], p, 0.0)
        ds = p * (plgpu.dot(do, v, trans_b=True) - delta[:, None])
        return dq + plgpu.dot(ds.astype(k.dtype), k)

    dq = lax.fori_loop(0, _num_steps(count, launch), body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * launch.sm_scale).astype(dq_ref.dtype)


def _dkdv_kernel(starts_ref, order_ref, *refs, launch: LaunchConfig, pairs_per_tile: int, masked: bool):
    if launch.masked_dkdv:
        masks_ref, *refs = refs
    else:
        masks_ref = None
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs = refs
    valid_ref, (dk_ref, dv_ref) = _split_valid(refs, masked)
    block = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    rows = k.shape[0]
    qt = launch.q_tile
    qk_scale = launch.sm_scale * LOG2E
    if masks_ref is not None:
        row_ids = lax.broadcasted_iota(jnp.int32, (rows,), 0)
        word_of_row, bit_of_row = lax.div(row_ids, MASK_BITS), lax.rem(row_ids, MASK_BITS)

    def body(i, carry):
        dk, dv = carry
        pair = order_ref[i]
        tile = lax.div(pair, pairs_per_tile)
        sl = pl.ds(pl.multiple_of(tile * qt, qt), qt)
        q, do = q_ref[sl, :], do_ref[sl, :]
        lse, delta = lse_ref[sl], delta_ref[sl]
        p = jnp.exp2(plgpu.dot(q, k, trans_b=True) * qk_scale - lse[:, None])  # [qt, rows]
        if masks_ref is not None:
            words = masks_ref[pair, word_of_row]
            picked = lax.shift_right_logical(words, bit_of_row) & 1
            p = jnp.where(picked[None, :] == 1, p, 0.0)
        dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True)
        ds = p * (plgpu.dot(do, v, trans_b=True) - delta[:, None])
        dk = dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True)
        return dk, dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(starts_ref[block], starts_ref[block + 1], body, (zeros, zeros))
    if valid_ref is not None:  # invalid key rows: their own column of p was never masked; drop it here
        keep = (valid_ref[...] != 0)[:, None]
        dk, dv = jnp.where(keep, dk, 0.0), jnp.where(keep, dv, 0.0)
    dk_ref[...] = (dk * launch.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------------------------
# pallas_call wrappers (inputs already padded and sanitized). key_valid: None, or int32 [B, S] row flags.


def _tile_specs(launch: LaunchConfig, s: int, dp: int, n_sel: int, tiles: int):
    qt = launch.q_tile
    count = pl.BlockSpec((None, None, tiles), lambda t, b, h: (b, h, 0))
    index = pl.BlockSpec((None, None, None, n_sel), lambda t, b, h: (b, h, t, 0))
    q_tile = pl.BlockSpec((None, qt, None, dp), lambda t, b, h: (b, t, h, 0))
    whole = pl.BlockSpec((None, s, None, dp), lambda t, b, h: (b, 0, h, 0))
    row_stat = pl.BlockSpec((None, None, qt), lambda t, b, h: (b, h, t))
    return count, index, q_tile, whole, row_stat


def _with_valid(in_specs, args, key_valid, spec):
    """Append key_valid (and its BlockSpec) to a call's inputs when the call masks padded keys."""
    if key_valid is None:
        return in_specs, args
    return [*in_specs, spec], [*args, key_valid]


def _forward(q, k, v, index, count, launch: LaunchConfig, key_valid=None):
    """(o, lse) with lse [B, H, S] in base 2 (+inf where a row has no valid key)."""
    b, s, h, dp = q.shape
    tiles, n_sel = index.shape[2], index.shape[3]
    count_s, index_s, tile_s, whole_s, stat_s = _tile_specs(launch, s, dp, n_sel, tiles)
    in_specs, args = _with_valid(
        [count_s, index_s, tile_s, whole_s, whole_s],
        [count, index, q, k, v],
        key_valid,
        pl.BlockSpec((None, s), lambda t, b, h: (b, 0)),
    )
    return pl.pallas_call(
        functools.partial(_fwd_kernel, launch=launch, masked=key_valid is not None),
        grid=(tiles, b, h),
        in_specs=in_specs,
        out_specs=[tile_s, stat_s],
        out_shape=[result_type(q.shape, q.dtype, q), result_type((b, h, s), jnp.float32, q)],
        compiler_params=_params(launch.tuning.fwd_warps, launch.tuning.fwd_stages),
        interpret=launch.interpret,
        name="sparse_attention_fwd",
    )(*args)


def _backward(q, k, v, index, count, o, lse, do, launch: LaunchConfig):
    """dq, dk, dv of the output alone (no lse cotangent, no padded keys); lse in base 2 as _forward's."""
    return _backward_from_delta(q, k, v, index, count, lse, do, row_term(o, do), launch)


def _backward_from_delta(q, k, v, index, count, lse, do, delta, launch: LaunchConfig, key_valid=None):
    b, s, h, dp = q.shape
    tiles, n_sel = index.shape[2], index.shape[3]
    masked = key_valid is not None
    count_s, index_s, tile_s, whole_s, stat_s = _tile_specs(launch, s, dp, n_sel, tiles)
    in_specs, args = _with_valid(
        [count_s, index_s, tile_s, whole_s, whole_s, tile_s, stat_s, stat_s],
        [count, index, q, k, v, do, lse, delta],
        key_valid,
        pl.BlockSpec((None, s), lambda t, b, h: (b, 0)),
    )
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, launch=launch, masked=masked),
        grid=(tiles, b, h),
        in_specs=in_specs,
        out_specs=tile_s,
        out_shape=result_type(q.shape, q.dtype, q),
        compiler_params=_params(launch.tuning.dq_warps, launch.tuning.dq_stages),
        interpret=launch.interpret,
        name="sparse_attention_dq",
    )(*args)

    rows = launch.dkdv_rows
    order, starts, masks, pairs_per_tile = dkdv_worklist(index, count, kv_block=launch.kv_block, rows=rows, seq_len=s)
    n_pairs = order.shape[-1]
    row_blocks = s // rows
    starts_s = pl.BlockSpec((None, None, row_blocks + 1), lambda j, b, h: (b, h, 0))
    order_s = pl.BlockSpec((None, None, n_pairs), lambda j, b, h: (b, h, 0))
    whole = pl.BlockSpec((None, s, None, dp), lambda j, b, h: (b, 0, h, 0))
    own = pl.BlockSpec((None, rows, None, dp), lambda j, b, h: (b, j, h, 0))
    stat = pl.BlockSpec((None, None, s), lambda j, b, h: (b, h, 0))
    in_specs, args = [starts_s, order_s], [starts, order]
    if masks is not None:
        in_specs.append(pl.BlockSpec((None, None, n_pairs, masks.shape[-1]), lambda j, b, h: (b, h, 0, 0)))
        args.append(masks)
    in_specs, args = _with_valid(
        in_specs + [whole, own, own, whole, stat, stat],
        args + [q, k, v, do, lse, delta],
        key_valid,
        pl.BlockSpec((None, rows), lambda j, b, h: (b, j)),
    )
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, launch=launch, pairs_per_tile=pairs_per_tile, masked=masked),
        grid=(row_blocks, b, h),
        in_specs=in_specs,
        out_specs=[own, own],
        out_shape=[result_type(k.shape, k.dtype, q), result_type(v.shape, v.dtype, q)],
        compiler_params=_params(launch.tuning.dkdv_warps, launch.tuning.dkdv_stages),
        interpret=launch.interpret,
        name="sparse_attention_dkdv",
    )(*args)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------
# Sharding over batch and heads: see pallas_kernels.partitioning.

_QKV, _SEL, _ROWS, _KEYS = ("bshd",) * 3, ("bhtk", "bht"), "bhs", "bs"  # key_valid [B, S] is batch-sharded

_forward_sharded = partitioned_over_batch_and_heads(_forward, _QKV + _SEL, ("bshd", _ROWS))
_backward_sharded = partitioned_over_batch_and_heads(
    _backward, _QKV + _SEL + ("bshd", _ROWS, "bshd"), ("bshd",) * 3
)  # (o, lse, do): the Mosaic GPU path's


def _forward_masked(q, k, v, index, count, key_valid, launch: LaunchConfig):
    return _forward(q, k, v, index, count, launch, key_valid)


def _backward_masked(q, k, v, index, count, lse, do, delta, key_valid, launch: LaunchConfig):
    return _backward_from_delta(q, k, v, index, count, lse, do, delta, launch, key_valid)


_forward_masked_sharded = partitioned_over_batch_and_heads(_forward_masked, _QKV + _SEL + (_KEYS,), ("bshd", _ROWS))
_backward_delta_sharded = partitioned_over_batch_and_heads(
    _backward_from_delta, _QKV + _SEL + (_ROWS, "bshd", _ROWS), ("bshd",) * 3
)
_backward_delta_masked_sharded = partitioned_over_batch_and_heads(
    _backward_masked, _QKV + _SEL + (_ROWS, "bshd", _ROWS, _KEYS), ("bshd",) * 3
)


def _run_forward(q, k, v, index, count, key_valid, launch: LaunchConfig):
    if key_valid is None:
        return _forward_sharded(q, k, v, index, count, launch)
    return _forward_masked_sharded(q, k, v, index, count, key_valid, launch)


def _run_backward(q, k, v, index, count, key_valid, lse, do, delta, launch: LaunchConfig):
    if key_valid is None:
        return _backward_delta_sharded(q, k, v, index, count, lse, do, delta, launch)
    return _backward_delta_masked_sharded(q, k, v, index, count, lse, do, delta, key_valid, launch)


# ----------------------------------------------------------------------------------------------------
# custom_vjp over padded, sanitized inputs. with_lse (static): the result is (o, lse natural log) and the
# backward takes the lse cotangent; else o alone, exactly the computation of a call without lse.


def _grads(q, k, v, index, count, key_valid, o, lse2, do, dlse, launch: LaunchConfig):
    """dq, dk, dv of this call's keys' share of an attention with softmax statistics (o, lse2): o's own
    forward (the VJP) or a larger merged attention (sparse_attention_pallas_backward)."""
    return _run_backward(q, k, v, index, count, key_valid, lse2, do, row_term(o, do, dlse), launch)


_attend = lse2_attention_vjp(_run_forward, _grads)


def prepare_index(kv_index, kv_count, launch: LaunchConfig, seq_len: int):
    """Sanitized kv_index padded to whole loop steps, and clipped counts."""
    index, count = sanitize_index(kv_index, kv_count, seq_len // launch.kv_block)
    n_sel = index.shape[-1]
    pad = launch.padded_count(n_sel) - n_sel
    if pad:
        index = jnp.pad(index, ((0, 0), (0, 0), (0, 0), (0, pad)))
    return index, count


def key_row_flags(kv_valid, kv_block: int):
    """int32 [B, S]: 1 where a key row is valid (its offset in its block < the block's kv_valid), else 0."""
    b, nb = kv_valid.shape
    valid = jnp.clip(kv_valid.astype(jnp.int32), 0, kv_block)
    return (jnp.arange(kv_block, dtype=jnp.int32) < valid[..., None]).astype(jnp.int32).reshape(b, nb * kv_block)


def _prepare(q, k, v, kv_index, kv_count, kv_valid, *, q_tile, kv_block, sm_scale, tuning, interpret):
    """Checks, the launch config, the sanitized index and the key row flags of one call."""
    reason = supported(q, k, v, q_tile=q_tile, kv_block=kv_block)
    if reason:
        raise ValueError(reason)
    launch = LaunchConfig(
        q_tile=q_tile,
        kv_block=kv_block,
        seq_len=q.shape[1],
        head_dim=q.shape[-1],
        sm_scale=float(sm_scale),
        tuning=tuning,
        interpret=interpret,
    )
    index, count = prepare_index(kv_index, kv_count, launch, q.shape[1])
    key_valid = None if kv_valid is None else key_row_flags(kv_valid, kv_block)
    return launch, index, count, key_valid


def _pad_head(*xs):
    """xs [B, S, H, D] zero-padded to the kernels' head dim (zeros leave q.k and p.v unchanged)."""
    d = xs[0].shape[-1]
    if padded_head_dim(d) == d:
        return xs
    pad = ((0, 0), (0, 0), (0, 0), (0, padded_head_dim(d) - d))
    return tuple(jnp.pad(x, pad) for x in xs)


def sparse_attention_pallas(
    q, k, v, kv_index, kv_count, *, q_tile, kv_block, sm_scale, tuning, interpret, kv_valid=None, return_lse=False
):
    """Inputs as the public sparse_attention (already checked); returns o [B, S, H, D] in q.dtype, or
    (o, lse [B, H, S] fp32 natural log) with return_lse."""
    launch, index, count, key_valid = _prepare(
        q,
        k,
        v,
        kv_index,
        kv_count,
        kv_valid,
        q_tile=q_tile,
        kv_block=kv_block,
        sm_scale=sm_scale,
        tuning=tuning,
        interpret=interpret,
    )
    d = q.shape[-1]
    out = _attend(*_pad_head(q, k, v), index, count, key_valid, launch, bool(return_lse))
    o, lse = out if return_lse else (out, None)
    o = o[..., :d]
    return (o, lse) if return_lse else o


def sparse_attention_pallas_backward(
    q, k, v, kv_index, kv_count, o, lse, do, dlse=None, *, q_tile, kv_block, sm_scale, tuning, interpret, kv_valid=None
):
    """Inputs as the public sparse_attention_backward (already checked): (dq, dk, dv) in the dtypes of
    q, k, v of this call's share of the attention whose merged statistics are o, lse (natural log)."""
    launch, index, count, key_valid = _prepare(
        q,
        k,
        v,
        kv_index,
        kv_count,
        kv_valid,
        q_tile=q_tile,
        kv_block=kv_block,
        sm_scale=sm_scale,
        tuning=tuning,
        interpret=interpret,
    )
    d = q.shape[-1]
    q, k, v, o, do = _pad_head(q, k, v, o, do.astype(q.dtype))
    grads = _grads(q, k, v, index, count, key_valid, o, kernel_lse(lse), do, dlse, launch)
    return tuple(g[..., :d] for g in grads)


# ----------------------------------------------------------------------------------------------------
# The dispatcher's interface (pallas_kernels.sparse_attention.Implementation): this GPU generation's tuning.


def attention(
    q, k, v, kv_index, kv_count, *, q_tile, kv_block, sm_scale, kv_valid=None, return_lse=False, interpret=False
):
    return sparse_attention_pallas(
        q,
        k,
        v,
        kv_index,
        kv_count,
        q_tile=q_tile,
        kv_block=kv_block,
        sm_scale=sm_scale,
        tuning=for_device()[0],
        interpret=interpret,
        kv_valid=kv_valid,
        return_lse=return_lse,
    )


def attention_backward(
    q, k, v, kv_index, kv_count, o, lse, do, dlse=None, *, q_tile, kv_block, sm_scale, kv_valid=None, interpret=False
):
    return sparse_attention_pallas_backward(
        q,
        k,
        v,
        kv_index,
        kv_count,
        o,
        lse,
        do,
        dlse,
        q_tile=q_tile,
        kv_block=kv_block,
        sm_scale=sm_scale,
        tuning=for_device()[0],
        interpret=interpret,
        kv_valid=kv_valid,
    )
