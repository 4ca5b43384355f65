"""Dense attention backends: XLA (any platform) and cuDNN flash attention (GPU).

Both take `kv_lens` (valid keys are a prefix) and `kv_mask` (bool [B, Skv] or [Skv]: any set of valid
keys, e.g. a padded token layout whose padding sits inside its tiles). XLA applies the mask to the
logits; cuDNN has no cheap general key mask, so its keys are gathered valid-first and masked by length
(attention does not depend on the order of its keys; the gather is memory-bound and small next to the
attention itself).

return_lse=True gives (o, lse [B, H, Sq] fp32, natural log) on both. jax (0.10) exposes cuDNN's softmax
statistics only through `jax.nn.dot_product_attention(..., return_residual=True)`, cast to the output
dtype (bf16: about 3 significant digits, too coarse to merge partial results exactly) and without a
gradient (cuDNN's backward drops the residual's cotangent). So o comes from the chosen implementation as
usual and lse from `softmax_lse`: plain JAX,
chunked over queries (memory O(chunk * Skv), never [Sq, Skv] for long keys), with its own backward
(d lse_i / d s_ij = p_ij, recomputed chunk by chunk). Its cost is one extra Q K^T pass forward and two
more backward, which the lse-merging call sites (MMDiT text part, context-parallel blocks) pay.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsv_jax.attention.registry import register_backend

LSE_CHUNK_BYTES = 256 << 20  # fp32 logits of one query chunk (all batch entries and heads)


def _lengths(kv_lens, batch):
    return None if kv_lens is None else jnp.broadcast_to(jnp.asarray(kv_lens, jnp.int32), (batch,))


def _key_mask(kv_lens, kv_mask, batch, skv):
    """bool [B, Skv] of the valid keys, or None when every key is valid."""
    if kv_mask is None and kv_lens is None:
        return None
    mask = (
        jnp.ones((batch, skv), bool) if kv_mask is None else jnp.broadcast_to(jnp.asarray(kv_mask, bool), (batch, skv))
    )
    if kv_lens is not None:
        mask = mask & (jnp.arange(skv)[None] < _lengths(kv_lens, batch)[:, None])
    return mask


def valid_first(k, v, mask):
    """k, v with each row's valid keys gathered first, and their counts: a key mask as lengths."""
    order = jnp.argsort(~mask, axis=1, stable=True)  # [B, Skv]: valid keys first
    take = lambda x: jnp.take_along_axis(x, order[:, :, None, None], axis=1)
    return take(k), take(v), jnp.sum(mask, axis=1, dtype=jnp.int32)


@register_backend("xla")
def xla_attention(q, k, v, *, kv_lens, sm_scale, kv_mask=None, return_lse=False, **options):
    _reject(options, "xla")
    return _attend(q, k, v, kv_lens, kv_mask, sm_scale, "xla", return_lse)


def _cudnn_suits(q) -> str | None:
    on_gpu = jax.devices()[0].platform == "gpu"
    return "cudnn" if on_gpu and q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[-1] <= 256 else None


@register_backend("cudnn", auto_rule=_cudnn_suits)
def cudnn_attention(q, k, v, *, kv_lens, sm_scale, kv_mask=None, return_lse=False, **options):
    _reject(options, "cudnn")
    return _attend(q, k, v, kv_lens, kv_mask, sm_scale, "cudnn", return_lse)


def _attend(q, k, v, kv_lens, kv_mask, sm_scale, implementation, return_lse):
    lengths = _lengths(kv_lens, q.shape[0])
    mask = None if kv_mask is None else _key_mask(kv_lens, kv_mask, q.shape[0], k.shape[1])
    if mask is None:
        o = jax.nn.dot_product_attention(
            q, k, v, scale=sm_scale, key_value_seq_lengths=lengths, implementation=implementation
        )
    elif implementation == "xla":
        o = jax.nn.dot_product_attention(q, k, v, scale=sm_scale, mask=mask[:, None, None, :], implementation="xla")
    else:
        k_first, v_first, counts = valid_first(k, v, mask)
        o = jax.nn.dot_product_attention(
            q, k_first, v_first, scale=sm_scale, key_value_seq_lengths=counts, implementation=implementation
        )
    if not return_lse:
        return o
    return o, softmax_lse(q, k, lengths, sm_scale, kv_mask=mask)


def _reject(options, name):
    if options:
        raise TypeError(f"attention backend {name!r} takes no options, got {sorted(options)}")


# -- log-sum-exp of q k^T, chunked over queries ------------------------------------------------------


def lse_chunk(batch: int, heads: int, kv_len: int, q_len: int) -> int:
    """Queries per chunk: a power of two (>= 16) whose fp32 logits fit LSE_CHUNK_BYTES, at most q_len."""
    rows = max(16, LSE_CHUNK_BYTES // max(1, 4 * batch * heads * kv_len))
    return min(q_len, 1 << (rows.bit_length() - 1))


def softmax_lse(q, k, kv_lens=None, sm_scale=None, chunk=None, kv_mask=None):
    """lse [B, H, Sq] fp32 = logsumexp_j (q_i . k_j * sm_scale) over the valid keys j (j < kv_lens[b] and
    kv_mask[b, j]; all if neither is given); -inf for a row without a key. Differentiable in q and k
    (no NaN for such rows)."""
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    b, sq, h, _ = q.shape
    chunk = chunk or lse_chunk(b, h, k.shape[1], sq)
    valid = _key_mask(kv_lens, kv_mask, b, k.shape[1])
    return _lse(q, k, jnp.ones((b, k.shape[1]), bool) if valid is None else valid, scale, chunk)


def _chunks(x, chunk):
    """[B, S, ...] -> [n, B, chunk, ...] (S zero-padded to whole chunks)."""
    pad = -x.shape[1] % chunk
    x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)) if pad else x
    return jnp.moveaxis(x.reshape(x.shape[0], -1, chunk, *x.shape[2:]), 1, 0)


def _logits(q_c, k, valid, scale):
    s = jnp.einsum("bqhd,bkhd->bhqk", q_c, k, preferred_element_type=jnp.float32) * scale
    return jnp.where(valid[:, None, None, :], s, -jnp.inf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _lse(q, k, valid, scale, chunk):
    return _lse_fwd(q, k, valid, scale, chunk)[0]


def _lse_fwd(q, k, valid, scale, chunk):
    def one(q_c):
        s = _logits(q_c, k, valid, scale)
        m = jnp.max(s, axis=-1)
        m = jnp.where(m == -jnp.inf, 0.0, m)
        l = jnp.sum(jnp.exp(s - m[..., None]), axis=-1)
        return jnp.where(l > 0.0, m + jnp.log(jnp.where(l > 0.0, l, 1.0)), -jnp.inf)  # [B, H, chunk]

    lse = jax.lax.map(one, _chunks(q, chunk))  # [n, B, H, chunk]
    lse = jnp.moveaxis(lse, 0, 2).reshape(q.shape[0], q.shape[2], -1)[..., : q.shape[1]]
    return lse, (q, k, valid, lse)


def _lse_bwd(scale, chunk, res, g):
    q, k, valid, lse = res
    b, sq, h, _ = q.shape
    # p = exp(s - lse); rows without a key (lse = -inf) get p = 0 through lse = +inf.
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)
    lse_c = _chunks(jnp.moveaxis(lse, 2, 1), chunk)  # [n, B, chunk, H]
    g_c = _chunks(jnp.moveaxis(g.astype(jnp.float32), 2, 1), chunk)

    def one(dk, args):
        q_c, lse_i, g_i = args
        p = jnp.exp(_logits(q_c, k, valid, scale) - jnp.moveaxis(lse_i, 2, 1)[..., None])
        gp = (p * jnp.moveaxis(g_i, 2, 1)[..., None]).astype(q.dtype)  # [B, H, chunk, Skv]
        dq_c = jnp.einsum("bhqk,bkhd->bqhd", gp, k, preferred_element_type=jnp.float32) * scale
        dk = dk + jnp.einsum("bhqk,bqhd->bkhd", gp, q_c, preferred_element_type=jnp.float32) * scale
        return dk, dq_c.astype(q.dtype)

    dk, dq = jax.lax.scan(one, jnp.zeros(k.shape, jnp.float32), (_chunks(q, chunk), lse_c, g_c))
    dq = jnp.moveaxis(dq, 0, 1).reshape(b, -1, h, q.shape[-1])[:, :sq]
    return dq, dk.astype(k.dtype), None


_lse.defvjp(_lse_fwd, _lse_bwd)
