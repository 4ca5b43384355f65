"""Dense attention backends: XLA (any platform) and cuDNN flash attention (GPU).

Both take `kv_lens` (valid keys are a prefix) and `kv_mask` (bool [B, Skv] or [Skv]: any set of valid
keys, e.g. a padded token layout whose padding sits inside its tiles). XLA applies the mask to the
logits; cuDNN has no cheap general key mask, so its keys are gathered valid-first and masked by length
(attention does not depend on the order of its keys; the gather is memory-bound and small next to the
attention itself).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv_jax.attention.registry import register_backend


def _lengths(kv_lens, batch):
    return None if kv_lens is None else jnp.broadcast_to(jnp.asarray(kv_lens, jnp.int32), (batch,))


def _key_mask(kv_lens, kv_mask, batch, skv):
    """bool [B, Skv] of the valid keys, or None when every key is valid."""
    if kv_mask is None and kv_lens is None:
        return None
    mask = jnp.ones((batch, skv), bool) if kv_mask is None else jnp.broadcast_to(jnp.asarray(kv_mask, bool),
                                                                                (batch, skv))
    if kv_lens is not None:
        mask = mask & (jnp.arange(skv)[None] < _lengths(kv_lens, batch)[:, None])
    return mask


@register_backend("xla")
def xla_attention(q, k, v, *, kv_lens, sm_scale, kv_mask=None, **options):
    _reject(options, "xla")
    if kv_mask is None:
        return jax.nn.dot_product_attention(q, k, v, scale=sm_scale, key_value_seq_lengths=_lengths(kv_lens, q.shape[0]),
                                            implementation="xla")
    mask = _key_mask(kv_lens, kv_mask, q.shape[0], k.shape[1])
    return jax.nn.dot_product_attention(q, k, v, scale=sm_scale, mask=mask[:, None, None, :], implementation="xla")


def valid_first(k, v, mask):
    """k, v with each row's valid keys gathered first, and their counts: a key mask as lengths."""
    order = jnp.argsort(~mask, axis=1, stable=True)  # [B, Skv]: valid keys first
    take = lambda x: jnp.take_along_axis(x, order[:, :, None, None], axis=1)  # noqa: E731
    return take(k), take(v), jnp.sum(mask, axis=1, dtype=jnp.int32)


def _cudnn_suits(q) -> str | None:
    on_gpu = jax.devices()[0].platform == "gpu"
    return "cudnn" if on_gpu and q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[-1] <= 256 else None


@register_backend("cudnn", auto_rule=_cudnn_suits)
def cudnn_attention(q, k, v, *, kv_lens, sm_scale, kv_mask=None, **options):
    _reject(options, "cudnn")
    if kv_mask is not None:
        k, v, kv_lens = valid_first(k, v, _key_mask(kv_lens, kv_mask, q.shape[0], k.shape[1]))
    return jax.nn.dot_product_attention(q, k, v, scale=sm_scale, key_value_seq_lengths=_lengths(kv_lens, q.shape[0]),
                                        implementation="cudnn")


def _reject(options, name):
    if options:
        raise TypeError(f"attention backend {name!r} takes no options, got {sorted(options)}")
