"""Dense attention backends: XLA (any platform) and cuDNN flash attention (GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv_jax.attention.registry import register_backend


def _lengths(kv_lens, batch):
    return None if kv_lens is None else jnp.broadcast_to(jnp.asarray(kv_lens, jnp.int32), (batch,))


@register_backend("xla")
def xla_attention(q, k, v, *, kv_lens, sm_scale, **options):
    _reject(options, "xla")
    return jax.nn.dot_product_attention(q, k, v, scale=sm_scale, key_value_seq_lengths=_lengths(kv_lens, q.shape[0]),
                                        implementation="xla")


def _cudnn_suits(q) -> str | None:
    on_gpu = jax.devices()[0].platform == "gpu"
    return "cudnn" if on_gpu and q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[-1] <= 256 else None


@register_backend("cudnn", auto_rule=_cudnn_suits)
def cudnn_attention(q, k, v, *, kv_lens, sm_scale, **options):
    _reject(options, "cudnn")
    return jax.nn.dot_product_attention(q, k, v, scale=sm_scale, key_value_seq_lengths=_lengths(kv_lens, q.shape[0]),
                                        implementation="cudnn")


def _reject(options, name):
    if options:
        raise TypeError(f"attention backend {name!r} takes no options, got {sorted(options)}")
