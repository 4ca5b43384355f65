"""Block-sparse attention in Pallas (Triton lowering): forward, dQ and dK/dV kernels and the custom_vjp.

Layout: q, k, v [B, S, H, Dp] with Dp = D padded to a power of two (zeros leave q.k unchanged);
kv_index [B, H, T, Kp] sanitized (entries past the count are 0) and padded so that a loop step never
reads past the end; kv_count [B, H, T].

  forward  grid (T, B, H): for kv_count[tile] selected blocks, `rows_per_step` KV rows per step, online
           softmax in base 2 (logits pre-multiplied by log2 e, so exp2 is one instruction); saves
           lse = m + log2(l) per row for the backward.
  dQ       grid (T, B, H): the same walk; recomputes p from lse, dq += (p * (do.v - delta)) k.
  dK/dV    grid (S // rows, B, H): each program owns `rows` key rows and walks the query tiles that
           selected them (sparse_index.dkdv_worklist: a transposed index built by a sort, no atomics);
           at token level a bit mask per pair zeroes the rows the tile did not select.

A loop step either covers `rows_per_step` consecutive rows of one block (kv_block a multiple of it:
plain contiguous loads) or gathers rows_per_step // kv_block selected blocks through a row-index vector
(token level and small blocks); entries past kv_count are masked in the last step only.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.partitioning import partitioned_over_batch_and_heads
from pallas_kernels.sparse_index import MASK_BITS, dkdv_worklist, result_type, sanitize_index
from pallas_kernels.tuning import SparseAttentionTuning

LOG2E = math.log2(math.e)
MASK_VALUE = -1e30  # finite: exp2(MASK_VALUE - m) is 0 without inf - inf


@dataclasses.dataclass(frozen=True)
class Plan:
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


def supported(q_tile: int, kv_block: int) -> str | None:
    """None if the Pallas kernels handle this geometry, else the reason."""
    if q_tile < 16 or q_tile & (q_tile - 1) or q_tile > 128:
        return f"q_tile={q_tile} must be a power of two in 16..128 for the Pallas kernels"
    if kv_block & (kv_block - 1):
        return f"kv_block={kv_block} must be a power of two for the Pallas kernels"
    return None


def _params(warps, stages):
    return plgpu.CompilerParams(num_warps=warps, num_stages=stages)


# ----------------------------------------------------------------------------------------------------
# KV walk shared by the forward and dQ kernels


def _kv_step(step, count, idx_ref, k_ref, v_ref, plan: Plan):
    """K, V rows [rows_per_step, Dp] of loop step `step` and the mask of live rows (None: all live)."""
    rows, kvb = plan.step_rows, plan.kv_block
    if plan.contiguous:
        first = step * rows
        block = idx_ref[lax.div(first, kvb)]
        start = pl.multiple_of(block * kvb + lax.rem(first, kvb), rows)
        sl = pl.ds(start, rows)
        return k_ref[sl, :], v_ref[sl, :], None
    flat = step * rows + lax.broadcasted_iota(jnp.int32, (rows,), 0)  # position in the selected-row stream
    entry = lax.div(flat, kvb)
    live = entry < count
    row = idx_ref[entry] * kvb + lax.rem(flat, kvb)  # gathered row ids (entries past count were sanitized to 0)
    return k_ref[row, :], v_ref[row, :], live


def _num_steps(count, plan: Plan):
    return lax.div(count * plan.kv_block + plan.step_rows - 1, plan.step_rows)


def _fwd_kernel(count_ref, idx_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, plan: Plan):
    count = count_ref[pl.program_id(0)]
    q = q_ref[...]
    qt, dp = q.shape
    qk_scale = plan.sm_scale * LOG2E

    def body(step, carry):
        acc, m_prev, l_prev = carry
        k, v, live = _kv_step(step, count, idx_ref, k_ref, v_ref, plan)
        s = plgpu.dot(q, k, trans_b=True) * qk_scale
        if live is not None:
            s = jnp.where(live[None, :], s, MASK_VALUE)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        alpha = jnp.exp2(m_prev - m_next)
        p = jnp.exp2(s - m_next[:, None])
        l_next = l_prev * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return acc, m_next, l_next

    init = (jnp.zeros((qt, dp), jnp.float32), jnp.full((qt,), -jnp.inf, jnp.float32),
            jnp.zeros((qt,), jnp.float32))
    acc, m, l = lax.fori_loop(0, _num_steps(count, plan), body, init)
    l = jnp.where(l == 0.0, 1.0, l)  # only for kv_count == 0, which the API excludes: o = 0, not NaN
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log2(l)


def _dq_kernel(count_ref, idx_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, plan: Plan):
    count = count_ref[pl.program_id(0)]
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    qk_scale = plan.sm_scale * LOG2E

    def body(step, dq):
        k, v, live = _kv_step(step, count, idx_ref, k_ref, v_ref, plan)
        p = jnp.exp2(plgpu.dot(q, k, trans_b=True) * qk_scale - lse[:, None])
        if live is not None:
            p = jnp.where(live[None, :], p, 0.0)
        ds = p * (plgpu.dot(do, v, trans_b=True) - delta[:, None])
        return dq + plgpu.dot(ds.astype(k.dtype), k)

    dq = lax.fori_loop(0, _num_steps(count, plan), body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * plan.sm_scale).astype(dq_ref.dtype)


def _dkdv_kernel(starts_ref, order_ref, *refs, plan: Plan, pairs_per_tile: int):
    if plan.masked_dkdv:
        masks_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs
    else:
        masks_ref = None
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs
    block = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    rows = k.shape[0]
    qt = plan.q_tile
    qk_scale = plan.sm_scale * LOG2E
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
    dk_ref[...] = (dk * plan.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------------------------
# pallas_call wrappers (inputs already padded and sanitized)


def _tile_specs(plan: Plan, s: int, dp: int, n_sel: int, tiles: int):
    qt = plan.q_tile
    count = pl.BlockSpec((None, None, tiles), lambda t, b, h: (b, h, 0))
    index = pl.BlockSpec((None, None, None, n_sel), lambda t, b, h: (b, h, t, 0))
    q_tile = pl.BlockSpec((None, qt, None, dp), lambda t, b, h: (b, t, h, 0))
    whole = pl.BlockSpec((None, s, None, dp), lambda t, b, h: (b, 0, h, 0))
    row_stat = pl.BlockSpec((None, None, qt), lambda t, b, h: (b, h, t))
    return count, index, q_tile, whole, row_stat


def _forward(q, k, v, index, count, plan: Plan):
    b, s, h, dp = q.shape
    tiles, n_sel = index.shape[2], index.shape[3]
    count_s, index_s, tile_s, whole_s, stat_s = _tile_specs(plan, s, dp, n_sel, tiles)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, plan=plan),
        grid=(tiles, b, h),
        in_specs=[count_s, index_s, tile_s, whole_s, whole_s],
        out_specs=[tile_s, stat_s],
        out_shape=[result_type(q.shape, q.dtype, q), result_type((b, h, s), jnp.float32, q)],
        compiler_params=_params(plan.tuning.fwd_warps, plan.tuning.fwd_stages),
        interpret=plan.interpret,
        name="sparse_attention_fwd",
    )(count, index, q, k, v)


def _backward(q, k, v, index, count, o, lse, do, plan: Plan):
    b, s, h, dp = q.shape
    tiles, n_sel = index.shape[2], index.shape[3]
    # Preprocess: delta = rowsum(o * do), one fused XLA reduction (memory-bound, as fast as a kernel).
    delta = jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32))
    count_s, index_s, tile_s, whole_s, stat_s = _tile_specs(plan, s, dp, n_sel, tiles)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, plan=plan),
        grid=(tiles, b, h),
        in_specs=[count_s, index_s, tile_s, whole_s, whole_s, tile_s, stat_s, stat_s],
        out_specs=tile_s,
        out_shape=result_type(q.shape, q.dtype, q),
        compiler_params=_params(plan.tuning.dq_warps, plan.tuning.dq_stages),
        interpret=plan.interpret,
        name="sparse_attention_dq",
    )(count, index, q, k, v, do, lse, delta)

    rows = plan.dkdv_rows
    order, starts, masks, pairs_per_tile = dkdv_worklist(index, count, kv_block=plan.kv_block, rows=rows, seq_len=s)
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
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, plan=plan, pairs_per_tile=pairs_per_tile),
        grid=(row_blocks, b, h),
        in_specs=in_specs + [whole, own, own, whole, stat, stat],
        out_specs=[own, own],
        out_shape=[result_type(k.shape, k.dtype, q), result_type(v.shape, v.dtype, q)],
        compiler_params=_params(plan.tuning.dkdv_warps, plan.tuning.dkdv_stages),
        interpret=plan.interpret,
        name="sparse_attention_dkdv",
    )(*args, q, k, v, do, lse, delta)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------
# Sharding over batch and heads: see pallas_kernels.partitioning.

_forward_sharded = partitioned_over_batch_and_heads(
    _forward, ("bshd", "bshd", "bshd", "bhtk", "bht"), ("bshd", "bhs"))
_backward_sharded = partitioned_over_batch_and_heads(
    _backward, ("bshd", "bshd", "bshd", "bhtk", "bht", "bshd", "bhs", "bshd"), ("bshd", "bshd", "bshd"))


# ----------------------------------------------------------------------------------------------------
# custom_vjp over padded, sanitized inputs


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attend(q, k, v, index, count, plan: Plan):
    return _forward_sharded(q, k, v, index, count, plan)[0]


def _attend_fwd(q, k, v, index, count, plan: Plan):
    o, lse = _forward_sharded(q, k, v, index, count, plan)
    return o, (q, k, v, index, count, o, lse)


def _attend_bwd(plan: Plan, res, do):
    q, k, v, index, count, o, lse = res
    dq, dk, dv = _backward_sharded(q, k, v, index, count, o, lse, do, plan)
    return dq, dk, dv, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def prepare_index(kv_index, kv_count, plan: Plan, seq_len: int):
    """Sanitized kv_index padded to whole loop steps, and clipped counts."""
    index, count = sanitize_index(kv_index, kv_count, seq_len // plan.kv_block)
    n_sel = index.shape[-1]
    pad = plan.padded_count(n_sel) - n_sel
    if pad:
        index = jnp.pad(index, ((0, 0), (0, 0), (0, 0), (0, pad)))
    return index, count


def sparse_attention_pallas(q, k, v, kv_index, kv_count, *, q_tile, kv_block, sm_scale, tuning, interpret):
    """Inputs as the public sparse_attention (already checked); returns o [B, S, H, D] in q.dtype."""
    reason = supported(q_tile, kv_block)
    if reason:
        raise ValueError(reason)
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"the Pallas kernels need one dtype for q, k, v; got {q.dtype}, {k.dtype}, {v.dtype}")
    d = q.shape[-1]
    dp = padded_head_dim(d)
    plan = Plan(q_tile=q_tile, kv_block=kv_block, seq_len=q.shape[1], head_dim=d, sm_scale=float(sm_scale),
                tuning=tuning, interpret=interpret)
    index, count = prepare_index(kv_index, kv_count, plan, q.shape[1])
    if dp != d:
        pad = ((0, 0), (0, 0), (0, 0), (0, dp - d))
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
    o = _attend(q, k, v, index, count, plan)
    return o[..., :d] if dp != d else o
