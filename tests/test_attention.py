import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv_jax.attention import attention, available_backends, register_backend, resolve_backend


def naive(q, k, v, kv_lens=None, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    if kv_lens is not None:
        logits = jnp.where(jnp.arange(k.shape[1])[None, None, None] < kv_lens[:, None, None, None], logits, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), v.astype(jnp.float32))


def qkv(b=2, sq=37, skv=29, h=3, d=16, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (b, sq, h, d)), jax.random.normal(ks[1], (b, skv, h, d)),
            jax.random.normal(ks[2], (b, skv, h, d)))


def test_xla_backend_matches_naive_with_lengths():
    q, k, v = qkv()
    lens = jnp.array([29, 11], jnp.int32)
    np.testing.assert_allclose(attention(q, k, v, backend="xla", kv_lens=lens), naive(q, k, v, lens), atol=1e-5)
    np.testing.assert_allclose(attention(q, k, v, backend="auto", sm_scale=0.3), naive(q, k, v, scale=0.3), atol=1e-5)


def test_auto_is_xla_on_cpu_and_unknown_backend_is_named():
    q, k, v = qkv()
    assert resolve_backend("auto", q) == "xla"
    assert {"xla", "cudnn"} <= set(available_backends())
    with pytest.raises(ValueError, match="unknown attention backend 'nope'.*xla"):
        attention(q, k, v, backend="nope")


def test_shape_errors():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="disagree"):
        attention(q[..., :8], k, v)


def test_registered_backend_reaches_call_sites():
    calls = []

    @register_backend("test_double")
    def double(q, k, v, *, kv_lens, sm_scale, factor=2.0):
        calls.append(factor)
        return factor * attention(q, k, v, backend="xla", kv_lens=kv_lens, sm_scale=sm_scale)

    q, k, v = qkv()
    out = attention(q, k, v, backend="test_double", factor=3.0)
    np.testing.assert_allclose(out, 3.0 * naive(q, k, v), atol=1e-5)
    assert calls == [3.0]
